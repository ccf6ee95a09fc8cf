"""cpuflash inside Hugging Face transformers: one registered attention implementation.

``import cpuflash.transformers`` needs torch and transformers
(``pip install -e ".[transformers]"`` in a clone); ``import cpuflash`` alone imports neither. Then::

    import cpuflash.transformers
    cpuflash.transformers.register()                       # the name "cpufa"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cpufa")

The name holds no "flash": transformers takes every implementation name containing "flash"
for a flash-attn kernel to fetch from its hub.

Two functions are registered under the name. The attention function receives the model's
query ``(B, Hq, Nq, D)`` and key/value ``(B, Hk, Nk, D)`` (the KV cache included) and returns
``(B, Nq, Hq, Dv)``, written straight into the tensor torch allocated. The mask function
replaces the dense ``(B, 1, Nq, Nk)`` mask with what cpuflash can apply without one, whenever
the model's mask is one of transformers' plain patterns (causal, sliding-window causal,
bidirectional, bidirectional window, and Llama 4's chunked causal when no sequence is left
padded) and the keys end where the queries end (every dynamic cache does): a tensor tagged
with cpuflash's keywords for the pattern that holds only the padding, ``(B, 1, 1, Nk)``, a
view of the model's 2-D attention mask (a placeholder of that shape when nothing is padded).
Any other mask (packed sequences, image-token overlays, left-padded chunks, static caches,
masks a model asks to be materialized) is built by transformers as for sdpa and applied as it
is, so the results are those of ``attn_implementation="eager"`` in every case (but for query
rows that see no key: 0 here, as in flash-attn), and fast in the common ones. Before
transformers 4.53 (no mask registry) the models' own float masks are read as a bias.

Under ``torch.no_grad()`` or ``torch.inference_mode()`` the tensors reach `cpuflash.attention`
(or, for a decoding step without padding, `cpuflash.attention_with_kvcache`) as numpy views of
torch's memory; with grad mode on and an input that requires grad (training), the call goes
through `cpuflash.torch.attention`, which is differentiable in q, k, v and the sinks.
"""

import numpy as np

from . import _extras, api

try:
    import torch
    import transformers
except ImportError as exc:
    raise _extras.missing("cpuflash.transformers", "torch and transformers",
                          "transformers") from exc

__all__ = ["register", "QuantizedKVCache"]

NAME = "cpufa"

# The attribute that marks a mask built by `attention_mask_function`; it holds the keywords
# (causal, window, chunk_size, mask) that give cpuflash the same visibility, and `skip_keys`:
# how many leading keys of the call no query sees (dropped, so that the first key starts a chunk)
_PATTERN = "_cpufa_keywords"

# The attribute of the placeholder key tensor a `QuantizedKVCache` layer returns: the layer
_QUANTIZED = "_cpufa_quantized_layer"

# Up to this many query rows per key/value head without a mask, a call goes to the split-KV
# decode kernel of `attention_with_kvcache`: one decoding step (Nq = 1) of any GQA group.
_DECODE_ROWS = 16


# -- torch <-> numpy without copies

def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 models need the `ml_dtypes` package "
                        "(pip install ml_dtypes)") from None
    return np.dtype(ml_dtypes.bfloat16)


def _numpy(t):
    """A numpy view of the CPU tensor `t`; bfloat16 bits are read as ml_dtypes' bfloat16."""
    if t.requires_grad:  # only parameters (sinks) get here with grad mode off
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())
    return t.numpy()


def _torch(a):
    """The torch tensor over the numpy array `a` (no copy)."""
    if a.dtype.kind == "V":  # ml_dtypes' bfloat16
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# -- the attention function

def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface, computed by cpuflash.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (its ``is_causal`` is read when no mask is given).
    query : (B, Hq, Nq, D) tensor
    key : (B, Hk, Nk, D) tensor
        The KV cache included; ``Hq % Hk == 0`` (grouped heads are never repeated).
    value : (B, Hk, Nk, Dv) tensor
    attention_mask : tensor or None
        What the mask function registered with it returned (a tagged padding mask, a dense
        bool mask), or a 4-D mask the caller made: bool (True = take part) or float (added to
        the scores, as eager adds it); None: the causal flag decides, as for sdpa.
    dropout : float
        Must be 0 (cpuflash has no dropout); models pass 0 outside training.
    scaling : float, optional
        Multiplies ``Q K^T``; default ``1 / sqrt(D)``.
    sliding_window : int, optional
        Not read: the masks carry the window (as for eager and sdpa).
    softcap : float, optional
        Gemma-2's logit soft-capping.
    s_aux : (Hq,) tensor, optional
        Attention sinks (gpt-oss).

    Returns
    -------
    out : (B, Nq, Hq, Dv) tensor, contiguous
    weights : None
        cpuflash never forms the attention weights.
    """
    if query.device.type != "cpu":
        raise ValueError(f"cpuflash runs on the CPU only, but the model's tensors are on "
                         f"{query.device}: use attn_implementation=\"sdpa\" there")
    if dropout:
        raise ValueError(f"cpuflash has no attention dropout, but the model asks for "
                         f"dropout={dropout} (training with attention_dropout > 0): set the "
                         f"config's attention dropout to 0, or train with "
                         f"attn_implementation=\"eager\" or \"sdpa\"")
    quantized = getattr(key, _QUANTIZED, None)  # the placeholder of a QuantizedKVCache layer
    keywords = _visibility(module, query, key, attention_mask, kwargs.get("is_causal"))
    if scaling is not None:
        keywords["scale"] = scaling
    if softcap:
        keywords["softcap"] = softcap
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:  # T5-style relative positions: added like a float mask
        bias = keywords.get("bias")
        keywords["bias"] = _wide(position_bias) if bias is None else bias + position_bias
    sinks = s_aux if s_aux is not None else kwargs.get("sinks")
    if sinks is not None and sinks.dtype != torch.float32:
        sinks = sinks.float()  # cpuflash's sinks are float32, whatever the model's dtype

    if quantized is not None:
        if not ("mask" in keywords or "bias" in keywords or keywords.get("crop_keys")
                or keywords.get("skip_keys") or torch.is_grad_enabled() and query.requires_grad):
            return _quantized_attention(query, quantized, sinks, keywords), None
        # padding masks, biases, gradients: the float path, on the dequantized cache
        key, value = quantized.dequantized(query.dtype)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return _differentiable(query, key, value, sinks, keywords), None

    key, value = _kept_keys(keywords, query, key, value)
    if sinks is not None:
        keywords["sinks"] = _numpy(sinks)
    bias = keywords.get("bias")
    if bias is not None:
        keywords["bias"] = _numpy(bias)
    # bshd views of the bhsd tensors: the output comes out in the (B, Nq, Hq, Dv) layout
    # the model reshapes, so no transposed copy follows
    q, k, v = (_numpy(t).swapaxes(1, 2) for t in (query, key, value))
    if ("mask" not in keywords and bias is None
            and q.shape[1] * (q.shape[2] // k.shape[2]) <= _DECODE_ROWS):
        # a decoding step: the split-KV kernel spreads the keys over the cores
        keywords.setdefault("causal", False)
        return _torch(api.attention_with_kvcache(q, k, v, layout="bshd", **keywords)), None
    out = query.new_empty((q.shape[0], q.shape[1], q.shape[2], value.shape[-1]))
    api.attention(q, k, v, layout="bshd", out=_numpy(out), **keywords)
    return out, None


def _quantized_attention(query, layer, sinks, keywords):
    """A step of a model on a `QuantizedKVCache`: its rows read in place by the decode kernel
    (the new keys were quantized into them by the layer's `update`)."""
    if sinks is not None:
        keywords["sinks"] = _numpy(sinks)
    keywords.setdefault("causal", False)
    q = _numpy(query).swapaxes(1, 2)  # bshd views: the output comes out as the model wants it
    k_cache, v_cache = (api.QuantizedKV(c.data.swapaxes(1, 2), c.scale.swapaxes(1, 2),
                                        rotated=layer.rotate)
                        for c in (layer.k_cache, layer.v_cache))
    out = api.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=layer.length,
                                     layout="bshd", integer_dot=layer.integer_dot, **keywords)
    return _torch(out)


def _visibility(module, query, key, mask, is_causal):
    """The keywords (causal, window, mask, bias) that say which keys each query sees."""
    if mask is None:
        # nothing from the mask function: the causal flag decides, read as sdpa reads it
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        n_q, n_k = query.shape[2], key.shape[2]
        if not causal or n_q == 1:
            return {}
        if n_k > n_q:  # sdpa aligns top-left: the first Nq keys (an empty static cache)
            return {"causal": True, "crop_keys": True}
        return {"causal": True}
    tagged = getattr(mask, _PATTERN, None)
    if tagged is not None:
        return dict(tagged)
    if mask.shape[-1] > key.shape[2]:  # older models' masks span a static cache: as eager
        mask = mask[..., :key.shape[2]]
    if mask.dtype == torch.bool:
        return {"mask": _numpy(mask)}
    return {"bias": _wide(mask)}


def _kept_keys(keywords, query, key, value):
    """The keys and values the call reads (the visibility keywords that say so are popped):
    the first Nq with `crop_keys`, all but the first `skip_keys` with that."""
    if keywords.pop("crop_keys", False):
        key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
    skip = keywords.pop("skip_keys", 0)
    if skip:
        key, value = key[:, :, skip:], value[:, :, skip:]
    return key, value


def _wide(bias):
    """A float bias as cpuflash adds it: float32 (float64 stays), whatever the model's dtype."""
    return bias if bias.dtype in (torch.float32, torch.float64) else bias.float()


def _differentiable(query, key, value, sinks, keywords):
    """The training path: `cpuflash.torch.attention` carries the gradients."""
    from . import torch as cpuflash_torch

    key, value = _kept_keys(keywords, query, key, value)
    if sinks is not None:
        keywords["sinks"] = sinks
    if "mask" in keywords:  # the numpy view of a bool tensor, as the mask function made it
        keywords["mask"] = torch.from_numpy(keywords["mask"])
    out = cpuflash_torch.attention(query.transpose(1, 2), key.transpose(1, 2),
                                   value.transpose(1, 2), layout="bshd", **keywords)
    return out.contiguous()


# -- the mask function

def _closure(fn):
    """The free variables of the closure `fn` by name ({} for a plain function)."""
    cells = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    return {name: cell.cell_contents for name, cell in zip(names, cells)}


def _plain_pattern(mask_function):
    """(causal, window, chunk_size) when `mask_function` is one of transformers' plain
    patterns, else None.

    The patterns are recognized by the functions masking_utils builds them from; anything
    else (an overlay, packed sequences, left-padded chunks, a user's function) is not plain.
    """
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return True, None, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None, None
    parts = _closure(mask_function).get("mask_functions")
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask" or \
            not isinstance(parts, tuple) or len(parts) != 2:
        return None
    overlay, base = parts
    closure = _closure(overlay)
    qualname = getattr(overlay, "__qualname__", "")
    if base is mu.causal_mask_function and qualname == "chunked_overlay.<locals>.inner_mask":
        # (kv_idx - pad) // size == (q_idx - pad) // size: the chunks start at each sequence's
        # first real token, which one chunk_size says only where no sequence is left padded
        size, left_padding = closure.get("chunk_size"), closure.get("left_padding")
        if isinstance(size, int) and size >= 1 and isinstance(left_padding, torch.Tensor) \
                and not left_padding.any():
            return True, None, size
        return None
    size = closure.get("sliding_window")
    if not isinstance(size, int) or size < 1:
        return None
    if base is mu.causal_mask_function and \
            qualname == "sliding_window_overlay.<locals>.inner_mask":
        return True, (size - 1, 0), None  # kv_idx > q_idx - size
    if base is mu.bidirectional_mask_function and \
            qualname == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        return False, (size, size), None  # |q_idx - kv_idx| <= size
    return None


def attention_mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                            mask_function=None, attention_mask=None,
                            allow_is_causal_skip=True, allow_is_bidirectional_skip=False,
                            **kwargs):
    """transformers' mask interface for cpuflash: the padding alone where the pattern is plain.

    Returns a bool tensor tagged with cpuflash's keywords for it (causal, window, and the mask
    when some key is padding): ``(B, 1, 1, Nk)``, a view of `attention_mask`, when some key is
    padding, else a placeholder of that shape; or, for any other mask, the dense bool mask sdpa
    would get (never None, so that a None reaching the attention function always means that
    the model made no mask).
    """
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    pattern = _plain_pattern(mask_function)
    if pattern is not None:
        causal, window, chunk_size = pattern
        # a model that asks for the mask to be built (to combine it with another) gets it built
        wants_dense = not (allow_is_causal_skip if causal else allow_is_bidirectional_skip)
        # causal and windows align the last query with the last key, as every dynamic cache
        # does; a static cache (keys beyond the filled ones) or an offset tensor does not
        aligned = (not causal and window is None) or (
            isinstance(q_offset, int) and isinstance(kv_offset, int)
            and kv_offset + kv_length == q_offset + q_length)
        skip = 0
        if chunk_size is not None and aligned:
            # cpuflash counts chunks from the call's first key: the keys before the first chunk
            # edge are dropped, which is exact when no query sees them (a chunked layer's
            # sliding cache starts chunk_size - 1 keys before the first query, mid-chunk)
            skip = -kv_offset % chunk_size
            aligned = kv_offset + skip <= q_offset
        if not wants_dense and aligned:
            return _padding_mask(attention_mask, batch_size, kv_length, kv_offset, causal,
                                 window, chunk_size, skip)
    kwargs.pop("local_size", None)  # sdpa skips by it; a mask here is always built
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, allow_is_causal_skip=False,
                        allow_is_bidirectional_skip=False, **kwargs)


def _padding_mask(attention_mask, batch_size, kv_length, kv_offset, causal, window,
                  chunk_size=None, skip=0):
    """The (B, 1, 1, Nk) view of the 2-D padding mask, or a placeholder if nothing is padded,
    tagged with the keywords that give cpuflash the whole mask (the call's keys start `skip`
    keys in)."""
    keywords = {"causal": True} if causal else {}
    if window is not None:
        keywords["window"] = window
    if chunk_size is not None:
        keywords["chunk_size"] = chunk_size
    if skip:
        keywords["skip_keys"] = skip
    if attention_mask is not None:
        keys = attention_mask[:, kv_offset:kv_offset + kv_length]
        if keys.shape[-1] < kv_length:  # keys past the mask's end are padding (as sdpa pads)
            keys = torch.nn.functional.pad(keys, (0, kv_length - keys.shape[-1]))
        if keys.dtype != torch.bool:
            keys = keys.bool()
        if not keys.all():
            mask = keys[:, None, None, :]
            # converted once here, read by every layer
            keywords["mask"] = _numpy(mask)[..., skip:]
            setattr(mask, _PATTERN, keywords)
            return mask
    mask = torch.ones((), dtype=torch.bool).expand(batch_size, 1, 1, kv_length)
    setattr(mask, _PATTERN, keywords)
    return mask


# -- registration

def register(name=NAME):
    """Register cpuflash with transformers under `name`; idempotent; returns the name.

    Afterwards ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` uses it.

    Parameters
    ----------
    name : str
        Must not contain "flash": transformers fetches every such name as a flash-attn kernel
        from its hub.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"`name` must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"`name` must not contain \"flash\" (transformers treats such names as "
                         f"flash-attn kernels to fetch from its hub), got {name!r}")
    if name in ("eager", "sdpa", "flex_attention") or name.startswith("paged"):
        raise ValueError(f"`name` {name!r} is one of transformers' own implementations; "
                         f"choose another (the default is {NAME!r})")
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is not None:
        interface.register(name, attention_forward)
    else:  # transformers 4.48-4.49: the registry is a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = attention_forward
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # before 4.53 models build eager's float masks, read here as a bias
        return name
    AttentionMaskInterface.register(name, attention_mask_function)
    return name


# -- a quantized KV cache

class _QuantizedLayer(transformers.cache_utils.DynamicLayer):
    """One attention layer's keys and values as quantized rows (`cpuflash.quantize_kv`: 8-bit
    with a float32 scale per (token, head), or int4 with one per group), in numpy arrays that
    grow by a fraction as tokens come.

    `update` quantizes the new keys and values into them and returns placeholders, tagged with
    the layer, that cpuflash's attention function reads through (`_quantized_attention`):
    ``(B, Hk, N, D)`` tensors of NaN that take no memory, so that a model run with another
    attention implementation fails loudly instead of attending to nothing.
    """

    is_croppable = False

    def __init__(self, dtype="int8", rotate=False, group_size=32, integer_dot=False, **kwargs):
        super().__init__(**kwargs)
        self.format, self.rotate, self.group_size = dtype, rotate, group_size
        self.integer_dot = integer_dot
        self.length = 0
        self.k_cache = self.v_cache = None

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        self._make_room(key_states.shape, value_states.shape[-1], self.length + n_new)
        end = self.length + n_new
        for cache, new in ((self.k_cache, key_states), (self.v_cache, value_states)):
            rows = self._quantized(_numpy(new.detach()), rotate=self.rotate)
            cache.data[:, :, self.length:end] = rows.data
            cache.scale[:, :, self.length:end] = rows.scale
        self.length = end
        return self._placeholder(self.k_cache), self._placeholder(self.v_cache)

    def _make_room(self, shape, d_v, needed):
        """Grow the arrays to hold `needed` tokens: exactly for the first (the prompt), then
        with a sixteenth (at least 64 tokens) to spare, so that a step rarely copies the cache
        and the spare stays small."""
        have = 0 if self.k_cache is None else self.k_cache.data.shape[2]
        if needed <= have:
            return
        # the prompt's keys exactly; then a sixteenth to spare as the tokens come
        capacity = needed if have == 0 else needed + max(64, needed // 16)
        grown = []
        for old, d in ((self.k_cache, shape[-1]), (self.v_cache, d_v)):
            empty = self._quantized(np.zeros((shape[0], shape[1], capacity, d), np.float32))
            if old is not None:
                empty.data[:, :, :self.length] = old.data[:, :, :self.length]
                empty.scale[:, :, :self.length] = old.scale[:, :, :self.length]
            grown.append(empty)
        self.k_cache, self.v_cache = grown

    def _quantized(self, x, rotate=False):
        return api.quantize_kv(x, self.format, group_size=self.group_size, rotate=rotate)

    def _placeholder(self, cache):
        d = cache.data.shape[3] * (2 if self.format == "int4" else 1)  # int4: two a byte
        shape = cache.data.shape[:2] + (self.length, d)
        placeholder = torch.full((), float("nan"), dtype=self.dtype).expand(shape)
        setattr(placeholder, _QUANTIZED, self)
        return placeholder

    def dequantized(self, dtype):
        """The cached keys and values as float tensors of `dtype` (the paths that need them:
        padding masks, gradients)."""
        return tuple(torch.from_numpy(api.dequantize_kv(api.QuantizedKV(
            c.data[:, :, :self.length], c.scale[:, :, :self.length], rotated=self.rotate)))
            .to(dtype) for c in (self.k_cache, self.v_cache))

    def get_seq_length(self):
        return self.length

    @property
    def nbytes(self):
        """Bytes the layer's arrays hold (rows and scales, the spare rows included)."""
        if self.k_cache is None:
            return 0
        return sum(c.data.nbytes + c.scale.nbytes for c in (self.k_cache, self.v_cache))

    def reset(self):
        self.length = 0
        self.k_cache = self.v_cache = None
        self.keys = self.values = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx):
        if self.k_cache is None:
            return
        index = beam_idx.cpu().numpy()
        self.k_cache, self.v_cache = (api.QuantizedKV(c.data[index], c.scale[index])
                                      for c in (self.k_cache, self.v_cache))

    def crop(self, tokens_to_remove):
        raise NotImplementedError("QuantizedKVCache cannot be cropped")


class QuantizedKVCache(transformers.cache_utils.Cache):
    """A KV cache of 8-bit or 4-bit keys and values that cpuflash attends to without
    dequantizing it.

    Pass it as ``cache=`` to ``model.forward`` or ``model.generate`` of a model on the "cpufa"
    attention implementation (`register`): transformers 5.24 takes that name, and its older
    ``past_key_values=`` still works but warns that it is deprecated. Each layer keeps its keys
    and values as `cpuflash.quantize_kv` makes them: int8 (or float8_e4m3fn) rows with one
    float32 scale per (token, head), about 0.27x the bytes of a float32 cache at head dim 64
    (0.26x at 128); or int4, two numbers a byte with a scale per group of `group_size`, 0.16x
    at group 32. Once decoding has begun, at most a sixteenth is spare (64 tokens for short
    sequences). New keys are quantized as they come, and the decode kernel reads the rows in
    place (`cpuflash.attention_with_kvcache`). Batches with padding, and gradients, attend to
    a dequantized copy instead.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (its number of layers).
    dtype : {"int8", "float8_e4m3", "int4"}
        The format.
    group_size : int
        int4 only: numbers of a row that share a scale (the head dims a multiple of it).
    rotate : bool
        Turn each key and value row by the Walsh-Hadamard matrix before quantizing
        (`cpuflash.quantize_kv`'s `rotate`; the head dims must be powers of two). For int4,
        it is what keeps a model's tokens close to the float cache's (docs/quantized_kv.md).
    integer_dot : bool
        int8 and int4 only, opt-in: decoding steps compute ``Q K^T`` in integers, each query
        row quantized to int8 (`cpuflash.attention_with_kvcache`'s `integer_dot`): faster,
        with the error docs/quantized_kv.md measures.
    """

    def __init__(self, config, dtype="int8", group_size=32, rotate=False, integer_dot=False):
        if dtype not in ("int8", "float8_e4m3", "int4"):
            raise ValueError(f"`dtype` must be 'int8', 'float8_e4m3' or 'int4', got {dtype!r}")
        if not isinstance(rotate, bool):
            raise TypeError(f"`rotate` must be True or False, got {rotate!r}")
        if not isinstance(integer_dot, bool):
            raise TypeError(f"`integer_dot` must be True or False, got {integer_dot!r}")
        if integer_dot and dtype == "float8_e4m3":
            raise ValueError("`integer_dot=True` needs dtype 'int8' or 'int4', got "
                             "'float8_e4m3'")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"`group_size` must be a positive int, got {group_size!r}")
        if dtype != "int4" and group_size != 32:
            raise ValueError(f"`group_size` applies to int4 only ({dtype} has one scale a "
                             f"row), got {group_size}")
        config = config.get_text_config(decoder=True)
        super().__init__(layers=[_QuantizedLayer(dtype, rotate, group_size, integer_dot)
                                 for _ in range(config.num_hidden_layers)])

    @property
    def nbytes(self):
        """Bytes the cache's arrays hold, over all layers."""
        return sum(layer.nbytes for layer in self.layers)
