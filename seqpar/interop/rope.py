"""Rotary-embedding settings in a Hugging Face ``config.json`` ⇄ seqpar's ``ModelConfig`` fields.

transformers ≥ 5 writes them in one dict, ``rope_parameters`` (``rope_type``, ``rope_theta``,
``factor``, …, ``partial_rotary_factor``); older versions write ``rope_theta`` and ``rope_scaling``
(``type`` or ``rope_type``, ``factor``, …) at the top level, GPT-NeoX ``rotary_emb_base`` and
``rotary_pct``. Every place a value can sit is read; where two places hold different values the
folder means different models to different transformers versions, and it is refused by name.
"""

from __future__ import annotations

from seqpar.config import ConfigError, ModelConfig

# Hugging Face rope_type -> seqpar
SCALINGS = {"default": "none", "linear": "linear", "llama3": "llama3"}
# keys a rope dict may hold, per rope_type (besides rope_type/type, rope_theta,
# partial_rotary_factor)
KEYS = {
    "default": (), "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def _agreed(name: str, places: dict[str, object], default):
    """The one value every place that holds one agrees on (``default`` when none does)."""
    found = {where: value for where, value in places.items() if value is not None}
    values = {
        float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
        for v in found.values()
    }
    if len(values) > 1:
        listed = ", ".join(f"{where}={value!r}" for where, value in found.items())
        raise ConfigError(f"config.json gives {name} twice with different values ({listed}): "
                          "transformers versions would read different models")
    return next(iter(found.values())) if found else default


def rope_from_hf(hf: dict, family: str) -> dict:
    """ModelConfig keyword arguments (``rope_theta``, ``rope_scaling`` and its factors) from a
    config dict."""
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    for where, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(d, dict) or any(isinstance(v, dict) for v in d.values()):
            raise ConfigError(
                f"{family} {where} must be one flat dict (per-layer rope settings are not "
                f"supported), got {d!r}"
            )

    def pick(key: str, default=None, *, alias: str | None = None, top: tuple[str, ...] = ()):
        places = {
            f"rope_parameters.{key}": params.get(key),
            f"rope_scaling.{key}": scaling.get(key),
        }
        if alias:
            places |= {
                f"rope_parameters.{alias}": params.get(alias),
                f"rope_scaling.{alias}": scaling.get(alias),
            }
        places |= {name: hf.get(name) for name in top}
        return _agreed(key, places, default)

    kind = pick("rope_type", "default", alias="type")
    if kind not in SCALINGS:
        raise ConfigError(f"{family} rope scaling type {kind!r} is not supported "
                          f"(seqpar implements {sorted(SCALINGS)})")
    extra = sorted((set(params) | set(scaling)) - COMMON - set(KEYS[kind]))
    if extra:
        raise ConfigError(
            f"{family} rope parameter {extra[0]!r} is not supported with rope_type {kind!r}"
        )
    partial = pick("partial_rotary_factor", 1.0, top=("partial_rotary_factor", "rotary_pct"))
    if float(partial) != 1.0:
        raise ConfigError(
            f"{family} partial_rotary_factor={partial} is not supported (seqpar rotates the whole "
            "head dimension: 1.0)"
        )
    out = {"rope_theta": float(pick("rope_theta", 10000.0, top=("rope_theta", "rotary_emb_base"))),
           "rope_scaling": SCALINGS[kind]}
    if kind == "default":
        return out
    # original_max_position_embeddings defaults to max_position_embeddings
    for key in KEYS[kind][:3]:
        if pick(key) is None:
            raise ConfigError(f"{family} rope_type {kind!r} needs {key!r} in rope_parameters")
    out["rope_factor"] = float(pick("factor"))
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(pick("low_freq_factor"))
        out["rope_high_freq_factor"] = float(pick("high_freq_factor"))
        original = pick(
            "original_max_position_embeddings", top=("original_max_position_embeddings",)
        )
        out["rope_original_max_len"] = int(
            original if original is not None else hf["max_position_embeddings"]
        )
    return out


def rope_to_hf(cfg: ModelConfig, partial_key: str | None = None) -> dict:
    """config.json entries: ``rope_parameters`` complete (transformers ≥ 5) and the top-level
    ``rope_theta`` / ``rope_scaling`` older versions read (``rope_scaling`` is the same complete
    dict, so transformers 5, which lets it replace ``rope_parameters``, reads the same model)."""
    kind, *values = cfg.rope_scaling_params
    params: dict = {
        "rope_type": {v: k for k, v in SCALINGS.items()}[kind],
        "rope_theta": cfg.rope_theta,
    }
    if partial_key:
        params["partial_rotary_factor"] = 1.0
    if kind in ("linear", "llama3"):
        params["factor"] = values[0]
    if kind == "llama3":
        params |= {"low_freq_factor": values[1], "high_freq_factor": values[2],
                   "original_max_position_embeddings": values[3]}
    out = {"rope_parameters": params, "rope_theta": cfg.rope_theta,
           "rope_scaling": dict(params) if kind != "none" else None}
    if partial_key:
        out[partial_key] = 1.0
    return out
