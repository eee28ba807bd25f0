from outlast.isolation.cgroup_v1 import CgroupV1
from outlast.isolation.cgroup_v2 import CgroupV2
from outlast.isolation.detect import detect, parse_mounts, parse_proc_cgroup

HYBRID_MOUNTS = """tmpfs /sys/fs/cgroup tmpfs rw 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
HYBRID_CGROUP = "4:memory:/process_api/abc\n2:cpu,cpuacct:/\n0::/\n"
UNIFIED_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n"


def test_hybrid_hosts_use_v1_with_each_controllers_own_path():
    d = detect("n1", None, HYBRID_MOUNTS, HYBRID_CGROUP)
    assert isinstance(d, CgroupV1)
    assert d.mem.base == "/sys/fs/cgroup/memory/process_api/abc"
    assert d.cpu.base == "/sys/fs/cgroup/cpu,cpuacct"


def test_unified_hosts_use_v2_and_accept_an_absolute_path():
    d = detect("n1", None, UNIFIED_MOUNTS, "0::/system.slice/outlast.service\n")
    assert isinstance(d, CgroupV2) and d.base == "/sys/fs/cgroup/system.slice/outlast.service"
    d = detect("n1", "/sys/fs/cgroup/jobs/a", UNIFIED_MOUNTS, "0::/\n")
    assert d.base == "/sys/fs/cgroup/jobs/a"


def test_parsers():
    assert parse_mounts(HYBRID_MOUNTS)[1]["cpu"] == "/sys/fs/cgroup/cpu,cpuacct"
    assert parse_proc_cgroup(HYBRID_CGROUP) == ("/", {"memory": "/process_api/abc", "cpu": "/", "cpuacct": "/"})
