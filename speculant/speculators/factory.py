"""Build the speculators an engine was configured with, from the registry (never by name checks)."""
from __future__ import annotations

import dataclasses

from speculant.speculators.base import Speculator, SpeculatorContext
from speculant.speculators.registry import speculator_class


def speculator_config(cls: type[Speculator], options: dict):
    """The speculator's own config dataclass, with `options` overriding its defaults."""
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        if options:
            raise ValueError(f"speculator {cls.name!r} takes no options, got {sorted(options)}")
        return None
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"speculator {cls.name!r}: unknown option(s) {unknown}; "
                         f"known: {sorted(known)}")
    return config_class(**options)


def create_speculators(config, ctx: SpeculatorContext) -> list[Speculator]:
    """One instance per configured type (`config.spec_type`), each given the context and its
    own options (`config.spec_options[name]`), never the engine. Classes that load files
    (models, heads) do it in a `from_context` constructor."""
    out = []
    for name in config.spec_type:
        cls = speculator_class(name)
        spec_config = speculator_config(cls, dict(config.spec_options.get(name, {})))
        builder = getattr(cls, "from_context", None)
        out.append(builder(ctx, spec_config) if builder else cls(ctx, spec_config))
    return out
