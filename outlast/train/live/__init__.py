"""Live recovery's rank side: a data-parallel group that outlives the death of any of its ranks.

A rank's death breaks the group's pending collective on every survivor at once (gloo sees the
socket close). The survivors are not restarted: they throw the step in flight away, wait for the
next membership the controller publishes in a store it holds, form a new group under that
membership's generation, and hand their state to the rank that replaced the dead one. No rank
hosts the rendezvous, so rank 0 dies like any other.

- `outlast.protocol.membership`: who holds which rank in a generation, and who sends the state to whom
  (pure; the controller makes them, so it lives below both).
- `step_commit`: whether a step is applied, from the votes of the ranks (pure).
- `rendezvous`: memberships published in and read from the controller's store.
- `commit_store`: a step's votes and verdict in that store.
- `group`: a gloo group formed for one generation; a peer's death raises `GroupBroken`.
- `state_transfer`: a state dict sent from one rank to another, checked against its checksum (xxh3-128).
- `live_rank`: the loop's calls, tying the above together.
"""
