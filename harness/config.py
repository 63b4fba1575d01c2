"""Configurations as frozen dataclasses, validated at construction (nanoGPT's ``GPTConfig``)."""

import dataclasses
import math
import numbers


class Config:
    """Base of a frozen configuration dataclass. A subclass lists its fields with commented defaults and
    checks them in ``check()`` with :meth:`one_of` and :meth:`between`; construction runs the check, so
    an object that exists is valid. :meth:`from_dict` refuses a field it does not know. Every refusal is
    a ``ValueError`` naming the field."""

    def __post_init__(self):
        self.check()

    def check(self):
        """Raise ValueError naming the first field out of range (subclasses extend this)."""

    @classmethod
    def from_dict(cls, values):
        """The configuration of a mapping of field names to values; an unknown name is a ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [name for name in values if name not in known]
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
        return cls(**values)

    def as_dict(self):
        """The fields in declaration order (the columns a result row starts with)."""
        return dataclasses.asdict(self)

    def replace(self, **changes):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def one_of(self, name, options):
        value = getattr(self, name)
        if value not in options:
            raise ValueError(f"{type(self).__name__}.{name} = {value!r} must be one of {tuple(options)}")

    def between(self, name, lo, hi, nan_ok=False):
        value = getattr(self, name)
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and (
            (nan_ok and math.isnan(value)) or lo <= value <= hi)
        if not ok:
            raise ValueError(f"{type(self).__name__}.{name} = {value!r} must be a number in [{lo}, {hi}]")
