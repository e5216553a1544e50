"""What ``fabricsim plan`` searches for FairScale (the ``search`` of its registry entry)."""

from __future__ import annotations

from collections.abc import Iterable

from sim.frameworks.common.search import Options, SearchPoint


def fairscale_options(pt: SearchPoint) -> Iterable[Options]:
    for reshard in (True, False):
        yield (("reshard_after_forward", reshard),)
