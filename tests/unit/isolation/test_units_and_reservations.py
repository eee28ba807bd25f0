import pytest

from outlast.isolation.config import IsolationConfig
from outlast.isolation.errors import BadSetting
from outlast.isolation.reservations import GiB, MiB, compute_reservations
from outlast.isolation.units import format_bytes, parse_bytes, parse_cpus


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * GiB), ("512MiB", 512 * MiB), ("512M", 512 * MiB), ("1.5G", int(1.5 * GiB)), ("1GB", 10**9),
    ("1073741824", GiB), (" 64 kib ", 64 * 1024), (300, 300),
])
def test_sizes_parse_with_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "2 GiBs", "-1G", "1.2.3G"])
def test_a_bad_size_names_the_setting_and_the_accepted_forms(text):
    with pytest.raises(BadSetting, match="--system-reserved-memory"):
        parse_bytes(text, "--system-reserved-memory")


def test_cores_parse_and_negative_cores_are_refused():
    assert parse_cpus("0.5") == 0.5
    with pytest.raises(BadSetting, match="not a number of cores"):
        parse_cpus("two")
    with pytest.raises(BadSetting, match="negative"):
        parse_cpus(-1)


def test_format_bytes_reads_naturally():
    assert format_bytes(512 * MiB) == "512 MiB"
    assert format_bytes(3 * GiB) == "3.00 GiB"


def test_default_memory_reservation_is_ten_percent_within_bounds():
    assert compute_reservations(16 * GiB, None, 8).system_memory == int(1.6 * GiB)
    assert compute_reservations(2 * GiB, None, 8).system_memory == 500 * MiB  # at least 500 MiB
    assert compute_reservations(512 * GiB, None, 8).system_memory == 10 * GiB  # at most 10 GiB


def test_total_is_the_smaller_of_physical_memory_and_the_starting_cgroup_limit():
    r = compute_reservations(64 * GiB, 4 * GiB, 8)
    assert r.total_memory == 4 * GiB and r.user_memory == 4 * GiB - 500 * MiB
    assert "cgroup limit 4.00 GiB" in r.reason


def test_default_cpu_reservation_is_five_percent_within_one_and_three_cores():
    assert compute_reservations(16 * GiB, None, 8).system_cpus == 1
    assert compute_reservations(16 * GiB, None, 40).system_cpus == 2
    assert compute_reservations(16 * GiB, None, 96).system_cpus == 3


def test_on_two_cores_the_default_leaves_workloads_at_least_half():
    r = compute_reservations(16 * GiB, None, 1)
    assert r.system_cpus == 0.5 and r.user_cpus == 0.5


def test_explicit_reservations_win_and_must_leave_room_for_workloads():
    r = compute_reservations(8 * GiB, None, 4, reserved_memory=1 * GiB, reserved_cpus=2)
    assert (r.system_memory, r.system_cpus) == (1 * GiB, 2)
    with pytest.raises(BadSetting, match="lower --system-reserved-memory"):
        compute_reservations(1 * GiB, None, 4, reserved_memory=1 * GiB)
    with pytest.raises(BadSetting, match="lower --system-reserved-cpu"):
        compute_reservations(8 * GiB, None, 4, reserved_cpus=4)


def test_cpu_weights_split_by_reserved_share():
    r = compute_reservations(8 * GiB, None, 4, reserved_cpus=1)
    assert r.system_weight(10000) == 2500


def test_a_reservation_without_isolation_is_an_error():
    with pytest.raises(BadSetting, match="without --enable-resource-isolation"):
        IsolationConfig(system_reserved_memory="1GiB")
    with pytest.raises(BadSetting, match="--system-reserved-cpu"):
        IsolationConfig(system_reserved_cpu=1)


def test_config_parses_units_and_round_trips_to_agent_arguments():
    c = IsolationConfig(enable_resource_isolation=True, system_reserved_memory="1GiB", system_reserved_cpu="0.5",
                        cgroup_path="/a/b")
    assert c.system_reserved_memory == GiB
    args = c.to_args()
    assert args[0] == "--enable-resource-isolation"
    assert args[args.index("--system-reserved-memory") + 1] == str(GiB)
    assert args[args.index("--cgroup-path") + 1] == "/a/b"
    assert IsolationConfig().to_args() == []
