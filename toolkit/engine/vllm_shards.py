"""Which elements of each checkpoint tensor one vLLM worker's own weight loaders read (its tensor-parallel
shard; nothing of a layer another pipeline stage holds), found by running them on nothing.

``model.load_weights`` runs over meta tensors of the checkpoint's shapes with the layers' parameters put
back on meta as vLLM's layerwise reload does (from the metadata vLLM records when it loads a model), under a
dispatch mode that records the view each loader copies from and lets no copy happen. A tensor read any
other way (a cast, a sum, an op a region cannot describe) is kept whole. A second pass runs the loaders
over meta tensors laid out as the worker will hand them its regions (``Slot``), and keeps whole any tensor
they do not read exactly its region from there. The live weights are put back untouched.
"""

from __future__ import annotations

import logging
from typing import Any

from toolkit.weights.shards import Region

logger = logging.getLogger(__name__)

View = tuple[tuple[int, ...], tuple[int, ...], int]
"""A view a loader copied from: shape, strides, offset (elements)."""


def _loaders_read(model: Any, tensors: dict[str, Any]) -> tuple[dict[str, set[View]], set[str]]:
    """Run ``model.load_weights`` over ``tensors`` (meta) with the model's layers on meta: per name the
    views its loaders copied from, and the names read otherwise (by an op that is not a view)."""
    import torch  # the vllm extra's
    import torch.utils._pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    owner = {t.untyped_storage()._cdata: n for n, t in tensors.items()}
    views: dict[str, set[View]] = {n: set() for n in tensors}
    other: set[str] = set()

    def names(args: Any) -> set[str]:
        return {n for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor) and a.is_meta
                and (n := owner.get(a.untyped_storage()._cdata))}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is torch.ops.aten.copy_.default and (src := names(args[1:])):
                s = args[1]
                views[next(iter(src))].add((tuple(s.shape), tuple(s.stride()), s.storage_offset()))
                return args[0]  # nothing is copied: the destination is a live weight or a meta one
            if not func.is_view:
                other.update(names((args, kwargs)))
            return func(*args, **kwargs)

    layers = list(model.modules())
    saved = [(layer, get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)) for layer in layers]
    wrapped: list[tuple[Any, Any]] = []
    try:
        for layer in layers:
            restore_layer_on_meta(layer, get_layerwise_info(layer))
            for t in get_layer_tensors(layer).values():
                # a reload before left its deferring wrapper on the recorded tensors: call what it wraps
                loader = getattr(t, "weight_loader", None)
                if loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
                    wrapped.append((t, loader))
                    while getattr(loader, "__name__", "") == "online_process_loader":
                        loader = loader.__wrapped__
                    t.weight_loader = loader
        with torch.no_grad(), Record():
            model.load_weights(iter(tensors.items()))
    finally:
        for t, loader in wrapped:
            t.weight_loader = loader
        for layer, (params, buffers), non_persistent in saved:
            for name in get_layer_tensors(layer):
                delattr(layer, name)
            for name, p in params.items():
                layer.register_parameter(name, p)
            for name, b in buffers.items():
                layer.register_buffer(name, b, persistent=name not in non_persistent)
    return views, other


def probe(model: Any, specs: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, Region]:
    """name -> the region of it this worker's loaders read, for each tensor of ``specs`` (name -> shape,
    torch dtype name) read as one region (none: read whole, or in a way no region names)."""
    import torch  # the vllm extra's

    def dtype(name: str) -> Any:
        return getattr(torch, specs[name][1])

    views, other = _loaders_read(model, {n: torch.empty(shape, dtype=dtype(n), device="meta")
                                         for n, (shape, _) in specs.items()})
    if not any(views.values()):
        raise RuntimeError("the model's loaders copied nothing from the checkpoint's tensors")
    out: dict[str, Region] = {}
    for name, seen in views.items():
        if name in other or len(seen) > 1:
            continue
        if not seen:
            out[name] = Region(0, 0, 0, 1)  # never read here (another stage's layer, a tied weight)
            continue
        region = Region.of_view(*next(iter(seen)), specs[name][0])
        if region is not None and 0 < region.numel < int(torch.Size(specs[name][0]).numel()):
            out[name] = region
    # Again, each tensor laid out as the worker will hand it over: every region read exactly, or kept whole.
    laid: dict[str, Any] = {}
    for name, (shape, _) in specs.items():
        layout = out[name].layout(shape) if name in out else None
        if layout is None:
            laid[name] = torch.empty(shape, dtype=dtype(name), device="meta")
        else:
            pre, span, strides = layout
            laid[name] = torch.empty(span, dtype=dtype(name), device="meta").as_strided(shape, strides, 0)
    views, other = _loaders_read(model, laid)
    for name, region in list(out.items()):
        if not _reads_exactly(views[name], name in other, region, specs[name][0]):
            logger.info("%s: its loader reads the region %s other than as a view of it: kept whole", name, region)
            del out[name]
    return out


def _reads_exactly(got: set[View], other: bool, region: Region, shape: tuple[int, ...]) -> bool:
    """Whether the loader, given the region laid out as a ``Slot`` lays it, copied exactly the region."""
    if not region.numel:
        return not got and not other
    if other or len(got) != 1:
        return False
    layout = region.layout(shape)
    assert layout is not None  # a region is one a layout reads
    pre = layout[0]
    read = Region.of_view(*next(iter(got)), (pre + region.numel,))
    return read is not None and (read.rows == 1 or read.cols == read.stride) and (read.offset, read.numel) == (
        pre, region.numel)
