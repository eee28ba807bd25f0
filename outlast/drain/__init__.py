"""Sources that ask a node to drain: the clouds' preemption notices.

`cloud` decides what a metadata answer means; `cloud_watchers` asks the metadata servers.
"""

from outlast.drain.cloud import Notice
from outlast.drain.cloud_watchers import (
    AwsWatcher,
    AzureWatcher,
    GcpWatcher,
    Watcher,
    detect_watchers,
)

__all__ = ["AwsWatcher", "AzureWatcher", "GcpWatcher", "Notice", "Watcher", "detect_watchers"]
