"""Strategy registry: a new strategy is one module plus one line here."""

from raylowcomm.strategies.ddp import Ddp
from raylowcomm.strategies.lofi import Lofi

STRATEGIES = {s.name: s for s in (Lofi, Ddp)}
