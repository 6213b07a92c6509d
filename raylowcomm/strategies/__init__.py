"""Strategy registry: a new strategy is one module plus one line here."""

from raylowcomm.strategies.ddp import Ddp
from raylowcomm.strategies.interlocking import Interlocking
from raylowcomm.strategies.lofi import Lofi
from raylowcomm.strategies.spsa import Spsa

STRATEGIES = {s.name: s for s in (Lofi, Ddp, Spsa, Interlocking)}
