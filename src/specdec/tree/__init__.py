"""The one draft type shared by every speculator: :class:`DraftTree`."""

from specdec.tree.draft_tree import DraftTree

__all__ = ["DraftTree"]
