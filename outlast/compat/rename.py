"""The mechanical port of a Ray Train script: every `ray.train` becomes `outlast.train`.

Ray's own scripts use `ray.train` in their bodies as well as their imports (`ray.train.report(...)`),
so the rename covers every occurrence, and Ray's V2 module paths (`ray.train.v2.api.<module>`,
`ray.train.v2.torch.<module>`, `ray.train.v2.jax.<module>`, `ray.train.v2.xgboost.<module>`) become
the outlast module that holds those names. Anything else
of Ray (`import ray`, `ray.init()`) is left as it is: `outlast run` runs such a script unchanged.
"""

from __future__ import annotations

import re

_V2_TORCH = re.compile(r"\bray\.train\.v2\.torch(?:\.\w+)*")
# Ray's V2 framework packages and their modules (lower case: a capitalised name after them is a class).
_V2_FRAMEWORK = re.compile(r"\bray\.train\.v2\.(jax|xgboost)(?:\.[a-z_]\w*)*")
_V2_API = re.compile(r"\bray\.train\.(?:v2\.api|v2)(?:\.\w+)*")
_TRAIN = re.compile(r"\bray\.train\b")


def rename_source(text: str) -> str:
    text = _V2_TORCH.sub("outlast.train.torch", text)
    text = _V2_FRAMEWORK.sub(r"outlast.train.\1", text)
    text = _V2_API.sub("outlast.train", text)
    return _TRAIN.sub("outlast.train", text)
