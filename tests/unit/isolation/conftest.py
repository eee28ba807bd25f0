import subprocess
import sys

import pytest

from outlast.procutil import FORK_SERVER_MODULE


@pytest.fixture
def dying_fork_server():
    """A live process that reads as a fork server (its command line names the module): what a
    killed agent leaves in its tree's system/ for the moment its fork server takes to end."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", FORK_SERVER_MODULE])
    yield p.pid
    p.kill()
    p.wait()
