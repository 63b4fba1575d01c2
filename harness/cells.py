"""Cells: the independent units of work of an experiment, and their random streams."""

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np


def cell_seeds(base_seed, key, n_seeds):
    """Per-seed uint64 stream seeds for one cell: SeedSequence([base_seed, crc32(key), i])."""
    crc = zlib.crc32(key.encode())
    return np.array([np.random.SeedSequence([int(base_seed), crc, i]).generate_state(1, np.uint64)[0]
                     for i in range(int(n_seeds))], dtype=np.uint64)


@dataclass(frozen=True)
class Cell:
    """One independent unit of work: its experiment, its kind (which ``run_cell`` function runs it),
    its settings (everything its result depends on, JSON-able), and how many seeds it runs.

    ``stream`` names what the cell's random streams depend on: the setting, not the sizes, so that a
    longer run (``--T``) extends the same streams. It defaults to (experiment, kind).
    """
    experiment: str
    kind: str
    settings: dict = field(default_factory=dict)
    seeds: int = 1
    base_seed: int = 0
    stream: tuple = ()

    @property
    def key(self):
        """A stable file name: the experiment and a hash of every field."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str)
        return f"{self.experiment}__{hashlib.sha1(blob.encode()).hexdigest()[:16]}"

    @property
    def stream_key(self):
        return json.dumps(list(self.stream or (self.experiment, self.kind)))

    def seed_array(self):
        """(seeds,) uint64 stream seeds of this cell (:func:`cell_seeds` of its stream key)."""
        return cell_seeds(self.base_seed, self.stream_key, self.seeds)

    @property
    def label(self):
        """A short description for the progress bar."""
        return " ".join(str(x) for x in (self.stream or (self.experiment, self.kind)))

    def __getitem__(self, name):
        return self.settings[name]

    def __hash__(self):                     # settings is a dict: hash the stable key instead
        return hash(self.key)


def sizes(table, quick, full=False, **overrides):
    """The size of each knob of ``table`` (name -> (default, quick) or (default, quick, full)) for this
    mode: ``quick``, ``full`` (a cluster-sized run; a knob without a third entry keeps its default) or
    the default.

    An override ``rounds=10**6`` replaces every knob whose name has the word ``rounds`` in it
    (``rounds``, ``veto_rounds``, ...); ``None`` leaves the table's value.
    """
    out = {name: (v[1] if quick else v[2] if full and len(v) > 2 else v[0]) for name, v in table.items()}
    for word, value in overrides.items():
        if value is not None:
            out.update({name: value for name in out if word in name.split("_")})
    return out
