"""Resource isolation of a node (docs/architecture.md, section 5): cgroup v1/v2 drivers, monitors, the kill policy.

`policy.py` decides (pure); `cgroup_v1.py` / `cgroup_v2.py` write cgroups (the root is an
argument); `node.py` puts them together for the agent.
"""

from outlast.isolation.config import IsolationConfig
from outlast.isolation.errors import BadSetting, IsolationError, IsolationUnavailable

__all__ = ["BadSetting", "IsolationConfig", "IsolationError", "IsolationUnavailable"]
