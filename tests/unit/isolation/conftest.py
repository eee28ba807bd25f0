import subprocess
import sys
import time

import pytest

from outlast.procutil import FORK_SERVER_MODULE, is_fork_server


@pytest.fixture
def dying_fork_server():
    """A live process that reads as a fork server (its command line names the module): what a
    killed agent leaves in its tree's system/ for the moment its fork server takes to end."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", FORK_SERVER_MODULE])
    deadline = time.monotonic() + 30  # a guest kernel's emulated CPU can be slow to show the new command line
    while not is_fork_server(p.pid):
        assert p.poll() is None and time.monotonic() < deadline, f"the stand-in fork server {p.pid} did not start"
        time.sleep(0.05)
    yield p.pid
    p.kill()
    p.wait()
