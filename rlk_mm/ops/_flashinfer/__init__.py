"""The FlashInfer backend (``pip install rlk-mm[gpu]``); imported only when asked for."""

__all__: list[str] = []
