from outlast.runenv import carried_env, worker_env


def test_the_run_carries_the_drivers_outlast_settings_and_its_named_variables_only():
    driver = {"PATH": "/driver/bin", "CUDA_VISIBLE_DEVICES": "3", "OUTLAST_UPLOAD_TRIES": "9",
              "OUTLAST_HOME": "/home/me/.outlast", "OUTLAST_CLUSTER_SECRET": "s", "OUTLAST_ADDRESS": "h:1"}
    assert carried_env(driver, {"env_vars": {"WANDB_MODE": "offline"}}) == {
        "OUTLAST_UPLOAD_TRIES": "9", "WANDB_MODE": "offline"}


def test_a_worker_starts_from_its_nodes_environment_without_the_cluster_secret():
    node = {"PATH": "/node/bin", "CUDA_VISIBLE_DEVICES": "0,1", "OUTLAST_CLUSTER_SECRET": "s"}
    env = worker_env(node, {"WANDB_MODE": "offline", "PATH": "/run/bin"})
    assert env == {"PATH": "/run/bin", "CUDA_VISIBLE_DEVICES": "0,1", "WANDB_MODE": "offline"}
