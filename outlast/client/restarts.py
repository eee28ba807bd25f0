"""When a process of the node that died comes back: at once, after a backoff, or never (pure).

The fork server is a cache of imported modules: losing it should cost a re-import, not the
node. One that dies again soon after its start is likely to die again (a broken preload, a
machine out of memory), so each quick death in a row doubles the wait, and after a few the
node stops and says why instead of spinning.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Restart:
    at: float  # the caller's clock
    reason: str


@dataclass(frozen=True)
class GiveUp:
    reason: str


@dataclass
class RestartPolicy:
    what: str = "the fork server"
    soon_s: float = 30.0  # a death within this long of the start counts as "again soon"
    max_quick_deaths: int = 3  # give up at the death after this many quick ones in a row
    backoff_s: float = 1.0  # the wait after the first quick death; doubles with each
    max_backoff_s: float = 30.0
    started_at: float | None = None  # of the latest restart; None while the first one runs
    quick: list[str] = field(default_factory=list)  # how each quick death in a row ended

    def on_death(self, now: float, how: str) -> Restart | GiveUp:
        """`how` is how it ended ("killed by SIGKILL", "exit code 1"). The caller restarts it at
        `Restart.at` and reports that with `restarted`."""
        if self.started_at is None or now - self.started_at >= self.soon_s:
            self.quick.clear()
            return Restart(now, f"{self.what} died ({how}); restarting it now")
        lived = now - self.started_at
        self.quick.append(how)
        if len(self.quick) > self.max_quick_deaths:
            return GiveUp(f"{self.what} died {len(self.quick)} times in a row, each within {self.soon_s:.0f} s of "
                          f"its start ({', '.join(self.quick)}); giving up. Its log above says why it dies "
                          f"(a module it preloads, or the machine's memory)")
        wait = min(self.backoff_s * 2 ** (len(self.quick) - 1), self.max_backoff_s)
        return Restart(now + wait, f"{self.what} died again ({how}) {lived:.1f} s after its start; "
                                   f"restarting it in {wait:.0f} s ({len(self.quick)} quick death(s) in a row, "
                                   f"giving up after {self.max_quick_deaths})")


    def restarted(self, now: float) -> None:
        self.started_at = now


def describe_exit(returncode: int | None) -> str:
    """How a child ended, from its Popen return code."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
