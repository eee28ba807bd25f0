"""Running Ray Train scripts on outlast: the `ray` alias of `outlast run`, the parity table."""
