"""Data as dicts of tensors (`Split`): any `datasets` source, read the same way on the driver and
on every node, split into test / val / train by a fixed seed, and sharded across nodes.

The driver never holds a training row. `describe_data` decides what the data is from schemas and
the label column (kind, columns, classes); `prepare_data` loads only the evaluation sets and
returns the training data as a recipe (`TrainSource`): small and picklable, it travels to a node,
which opens its own files (data.node_files) or the shared source (Arrow, memory-mapped) and
encodes only the rows it trains on. Rows become tensors in `Encoder`, with the class map the
driver decided, so every node and every shift set numbers the classes the same way.

The package, from the source up: `sources` (where rows come from, columns, kinds, label names),
`rows` (rows -> tensors: `Encoder`, `pixels`, `Rows`, unreadable and empty cells), `recipe` (what
the data is: `describe_data`, `DataPlan`, `SplitRule`, node files, shift sets) and `prepared`
(`prepare_data`, `PreparedData`, `TrainSource`). The names other modules use come from here.
"""

from raylowcomm.data.prepared import PreparedData, TrainSource, prepare_data
from raylowcomm.data.recipe import DataPlan, NodeFiles, SplitRule, describe_data
from raylowcomm.data.rows import Encoder, pixels
from raylowcomm.data.sources import SourceSpec, sorted_labels

__all__ = [
    "DataPlan",
    "PreparedData",
    "SourceSpec",
    "SplitRule",
    "TrainSource",
    "describe_data",
    "pixels",
    "prepare_data",
    "sorted_labels",
]

# The recipe crosses to every node pickled, and pickle names each class by its module: under the
# package's public name, what crosses (and the ledger's setup/data_recipe bytes) does not depend on
# which file of the package holds a class.
for _recipe_class in (TrainSource, Encoder, SplitRule, NodeFiles, SourceSpec):
    _recipe_class.__module__ = __name__
