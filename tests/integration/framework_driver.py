"""A driver of one framework's run, for the tests that kill it and start it again:

    python -m tests.integration.framework_driver FRAMEWORK STORAGE CONFIG_JSON
"""

import json
import sys

from tests.integration.framework_jobs import make_trainer

if __name__ == "__main__":
    framework, storage, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    make_trainer(framework, storage, config).fit()
