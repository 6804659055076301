"""What the plugin keeps on an SGLang radix-tree node: one ``NodeState``.

SGLang's ``UnifiedTreeNode`` has no ``__slots__``, so the plugin could hang any
attribute on it; it hangs exactly one, ``NODE_STATE``, holding a slotted
:class:`NodeState`. The object is created here and nowhere else, lazily, the
first time a writer records something about the node (:func:`node_state`): most
nodes are never attended, and eviction over them must not allocate. Readers use
:func:`peek_state` and treat None as "nothing recorded".

One object instead of loose attributes, so a reader cannot misspell a field into a
silent default, ``test/unit/test_sglang_contract.py`` can check that SGLang's node
never grows an attribute of the same name, and a node's whole plugin state is in
one place when a split copies it.

Nothing here imports SGLang, nor torch at run time (its types only for checking).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from sgl_importance.sglang_types.tree import TreeNode

# The one attribute the plugin sets on SGLang's tree nodes.
NODE_STATE = "sgl_importance"


class NodeState:
    """The plugin's state of one radix-tree node.

    Attributes:
        importance: moving average of the node's attention density
            (``aggregator.py``), or restored from the storage tier (``cache/stored.py``);
            None while neither happened.
        pinned: the node lies inside the attention-sink pages of its sequence.
        step: the aggregator's clock when the node was last attended.
        steps: recorded decode steps in which the node was attended.
        start: token offset of the node's first token in its sequence, None until
            a fold saw it.
        storage: L3 admission decision (``cache/admission.py``): None (undecided),
            ``"deferred"`` or ``"admitted"``.
        prefetched: why a prefetch loaded the node (``"waiting"`` / ``"warm"``,
            ``cache/prefetch.py``), None once used or evicted.
        prefetch_wasted: a warm prefetch of the node was evicted unused.
        pages: ``(device value, page ids)``: the node's physical pages, cached by
            ``scheduler/fold.py`` until SGLang replaces the value tensor.
    """

    __slots__ = (
        "importance",
        "pinned",
        "step",
        "steps",
        "start",
        "storage",
        "prefetched",
        "prefetch_wasted",
        "pages",
    )

    def __init__(self) -> None:
        self.importance: Optional[float] = None
        self.pinned = False
        self.step = 0
        self.steps = 0
        self.start: Optional[int] = None
        self.storage: Optional[str] = None
        self.prefetched: Optional[str] = None
        self.prefetch_wasted = False
        self.pages: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def __repr__(self) -> str:
        # Without the page tensors: this is for test failure messages.
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__ if name != "pages")
        return f"NodeState({fields})"


def peek_state(node: TreeNode) -> Optional[NodeState]:
    """The node's state, or None when the plugin never recorded anything about it."""
    # A default, not an error: the state is created lazily (see the module docstring).
    return getattr(node, NODE_STATE, None)


def node_state(node: TreeNode) -> NodeState:
    """The node's state, created on first use: the one place that creates it."""
    state = getattr(node, NODE_STATE, None)  # absent until this first runs on the node
    if state is None:
        state = NodeState()
        setattr(node, NODE_STATE, state)
    return state


def node_importance(node: TreeNode) -> float:
    """A node's persistent importance (0.0 for a node never attended nor restored)."""
    state = getattr(node, NODE_STATE, None)  # absent until node_state() first runs
    if state is None or state.importance is None:
        return 0.0
    return state.importance


def has_importance(node: TreeNode) -> bool:
    """Whether a fold or the storage tier ever gave the node an importance."""
    state = getattr(node, NODE_STATE, None)  # absent until node_state() first runs
    return state is not None and state.importance is not None


def node_pinned(node: TreeNode) -> bool:
    """Whether the node is an attention-sink node (evicted last under ``pin_sinks``)."""
    state = getattr(node, NODE_STATE, None)  # absent until node_state() first runs
    return state is not None and state.pinned
