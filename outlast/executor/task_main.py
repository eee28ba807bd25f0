"""What a freshly forked executor task does: call the function, send the outcome, exit.

The fork server runs it by module path (outlast/agent/zygote.py); the agent never imports it.
"""

from __future__ import annotations

import os

import cloudpickle
import zmq

from outlast.procutil import become_clean_process, user_traceback
from outlast.protocol import messages as m
from outlast.protocol.run_credential import worker_key
from outlast.runenv import worker_env
from outlast.threads import follow_cpu_share
from outlast.protocol.transport import connect_dealer, encode


def run(req: m.ForkTask) -> int:
    """An `outlast.Executor` task: call the function, send the outcome, exit."""
    become_clean_process(worker_env(os.environ, req.env), req.cwd, req.sys_path)
    follow_cpu_share(req.threads)
    os.environ["OUTLAST_TASK_ID"] = req.task_id
    ctx = zmq.Context()
    sock = connect_dealer(ctx, req.controller_address, f"task:{req.task_id}:{os.getpid()}".encode(),
                          key=worker_key())
    try:
        try:
            fn, args, kwargs = cloudpickle.loads(req.payload)
            value = fn(*args, **kwargs)
            msg = m.TaskResult(task_id=req.task_id, ok=True, payload=cloudpickle.dumps(value))
        except Exception as e:
            err = m.WorkerError(exc_type=type(e).__name__, message=str(e), phase="task",
                                traceback=user_traceback(e, __file__))
            try:
                blob = cloudpickle.dumps(e)
            except Exception:
                blob = b""
            msg = m.TaskResult(task_id=req.task_id, ok=False, payload=blob, error=err)
        try:
            sock.send(encode(msg))
        except TypeError:
            pass
        return 0
    finally:
        sock.close(linger=5000)  # the result must reach the executor before the process ends
        ctx.term()
