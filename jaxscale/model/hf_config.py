"""A Hugging Face `config.json` read as the fields of a jaxscale ModelConfig, offline.

`--model PATH/config.json` takes the shape of a published model from the file its
repository ships (LlamaConfig's, MixtralConfig's or GPT2Config's fields), without
downloading anything and without the transformers package. Every field of the file is
accounted for: read into the model, or known not to change what jaxscale computes (token
ids, dtypes, dropout: jaxscale trains without it); any other field, or a value jaxscale
does not compute (another activation, another RoPE scaling), is an error that names it,
since a model read wrong would give every figure after it wrong.

Returns plain keyword arguments: jaxscale.model.config builds the ModelConfig (this
module does not import it, so that the presets can name files).
"""
from __future__ import annotations

import json
from pathlib import Path


class HFConfigError(ValueError):
    """A config.json that is not a model jaxscale can build."""


# fields that do not change the computation jaxscale runs (read and set aside)
METADATA = {"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
            "dtype", "transformers_version", "use_cache", "_name_or_path", "model_type",
            "pretraining_tp", "tokenizer_class", "task_specific_params", "n_ctx",
            "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
            "summary_first_dropout", "scale_attn_weights", "reorder_and_upcast_attn",
            "output_past", "gradient_checkpointing", "initializer_factor",
            "output_router_logits"}
DROPOUT = {"attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
           "mlp_dropout"}

LLAMA = {"vocab_size": "vocab_size", "hidden_size": "d_model",
         "intermediate_size": "d_ff", "num_hidden_layers": "n_layers",
         "num_attention_heads": "n_heads", "max_position_embeddings": "seq_len"}
LLAMA_OPTIONAL = {"num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_scaling",
                  "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act",
                  "head_dim", "initializer_range"}
# Mixtral: Llama's blocks with a mixture of experts in the MLP's place (intermediate_size:
# each expert's width); its router learns under the load-balancing loss alone (no z-loss)
MIXTRAL = {**LLAMA, "num_local_experts": "n_experts", "num_experts_per_tok": "top_k"}
MIXTRAL_OPTIONAL = LLAMA_OPTIONAL | {"router_aux_loss_coef", "sliding_window",
                                     "router_jitter_noise"}
GPT2 = {"vocab_size": "vocab_size", "n_embd": "d_model", "n_layer": "n_layers",
        "n_head": "n_heads", "n_positions": "seq_len"}
GPT2_OPTIONAL = {"n_inner", "activation_function", "layer_norm_epsilon",
                 "tie_word_embeddings", "initializer_range", "scale_attn_by_inverse_layer_idx"}


def read(path: str | Path) -> dict:
    """ModelConfig keyword arguments from a config.json (model_type llama, mixtral or
    gpt2)."""
    path = Path(path)
    try:
        fields = json.loads(path.read_text())
    except OSError as e:
        raise HFConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path} is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise HFConfigError(f"{path} holds a JSON {type(fields).__name__}, not a config object")
    kind = fields.get("model_type")
    kinds = {"llama": (LLAMA, LLAMA_OPTIONAL), "mixtral": (MIXTRAL, MIXTRAL_OPTIONAL),
             "gpt2": (GPT2, GPT2_OPTIONAL)}
    if kind not in kinds:
        raise HFConfigError(f"{path}: model_type {kind!r} is not one jaxscale builds; "
                            f"it reads {', '.join(kinds)} configs")
    required, optional = kinds[kind]
    _check_fields(path, fields, required, optional)
    kwargs = {ours: _positive(path, fields, theirs) for theirs, ours in required.items()}
    if kind == "mixtral":
        return _mixtral(path, fields, kwargs)
    return (_llama if kind == "llama" else _gpt2)(path, fields, kwargs)


def _mixtral(path, fields, kw) -> dict:
    """Llama's fields, and the experts': no sliding window, no router noise. The router's
    coefficient is converted to jaxscale's weight: transformers computes Switch's loss
    once over every layer's tokens together with f_i summing to top_k, jaxscale once per
    layer with f_i summing to 1 and the layers' losses summed, so the same loss is
    coefficient x top_k / layers here (exactly so when the layers route alike)."""
    for name, off in (("sliding_window", None), ("router_jitter_noise", 0)):
        if fields.get(name, off) not in (off, 0.0 if off == 0 else off):
            _refuse(path, name, fields[name], f"{off!r} (full causal attention, a "
                                              "deterministic router)")
    coefficient = float(fields.get("router_aux_loss_coef", 0.001))  # MixtralConfig's default
    return {**_llama(path, fields, kw), "router_z_weight": 0.0,
            "router_aux_weight": coefficient * kw["top_k"] / kw["n_layers"]}


def _check_fields(path, fields, required, optional) -> None:
    missing = sorted(set(required) - set(fields))
    if missing:
        raise HFConfigError(f"{path} lacks {', '.join(missing)} (a {fields['model_type']} "
                            f"config needs {', '.join(required)})")
    unknown = sorted(set(fields) - set(required) - optional - METADATA - DROPOUT)
    if unknown:
        raise HFConfigError(f"{path} has fields jaxscale does not know: {', '.join(unknown)} "
                            "(each could change the model; remove them only if it does not)")


def _positive(path, fields, name):
    value = fields[name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise HFConfigError(f"{path}: {name} must be a positive whole number, got {value!r}")
    return value


def _refuse(path, name, value, valid) -> None:
    raise HFConfigError(f"{path}: {name} {value!r} is not computed by jaxscale; it "
                        f"computes {valid}")


def _llama(path, fields, kw) -> dict:
    if fields.get("hidden_act", "silu") != "silu":
        _refuse(path, "hidden_act", fields["hidden_act"], "'silu' (SwiGLU)")
    if bool(fields.get("attention_bias", False)) != bool(fields.get("mlp_bias", False)):
        _refuse(path, "attention_bias/mlp_bias", (fields.get("attention_bias"),
                                                  fields.get("mlp_bias")), "both or neither")
    head_dim = fields.get("head_dim")
    if head_dim is not None and head_dim * kw["n_heads"] != kw["d_model"]:
        _refuse(path, "head_dim", head_dim, f"hidden_size / num_attention_heads = "
                                            f"{kw['d_model'] // kw['n_heads']}")
    kv = fields.get("num_key_value_heads") or kw["n_heads"]
    return {**kw, "norm": "rmsnorm", "mlp": "swiglu", "position": "rope",
            "n_kv_heads": 0 if kv == kw["n_heads"] else kv,
            "rope_theta": float(fields.get("rope_theta", 10_000.0)),
            "rope_scaling": _rope_scaling(path, fields.get("rope_scaling")),
            "norm_eps": float(fields.get("rms_norm_eps", 1e-6)),
            "tied_head": bool(fields.get("tie_word_embeddings", False)),
            "bias": bool(fields.get("attention_bias", False)),
            "init_std": float(fields.get("initializer_range", 0.02))}


def _rope_scaling(path, scaling) -> tuple:
    """Llama 3.1's rope_scaling as (factor, low_freq_factor, high_freq_factor, original
    context); () for none."""
    if scaling is None:
        return ()
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind != "llama3":
        _refuse(path, "rope_scaling", scaling, "none or rope_type 'llama3'")
    try:
        return (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                float(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise HFConfigError(f"{path}: rope_scaling lacks {e.args[0]}") from None


def _gpt2(path, fields, kw) -> dict:
    if fields.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        _refuse(path, "activation_function", fields["activation_function"],
                "'gelu_new' (GELU's tanh approximation)")
    if fields.get("scale_attn_by_inverse_layer_idx"):
        _refuse(path, "scale_attn_by_inverse_layer_idx", True, "false")
    if not fields.get("tie_word_embeddings", True):
        kw["tied_head"] = False
    return {**kw, "d_ff": fields.get("n_inner") or 4 * kw["d_model"],
            "norm_eps": float(fields.get("layer_norm_epsilon", 1e-5)),
            "init_std": float(fields.get("initializer_range", 0.02))}
