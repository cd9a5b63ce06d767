"""roundel for PyTorch Lightning 2.x: ``Trainer(strategy=RoundelStrategy())`` or ``Trainer(strategy="roundel")``.

Importing this package registers ``"roundel"`` in Lightning's strategy
registry. It needs the ``lightning`` package (``pip install "roundel[lightning]"``);
the older ``pytorch_lightning`` import name has classes of its own, which a
``lightning.pytorch.Trainer`` strategy cannot serve.
"""

try:
    import lightning.pytorch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'roundel.lightning needs PyTorch Lightning 2.x, the "lightning" package: pip install "roundel[lightning]" '
        f"({exc})") from exc

from lightning.pytorch.strategies import StrategyRegistry

from roundel.lightning.strategy import RoundelEnvironment, RoundelStrategy, RoundelSyncBatchNorm

__all__ = ["RoundelEnvironment", "RoundelStrategy", "RoundelSyncBatchNorm"]

if RoundelStrategy.strategy_name not in StrategyRegistry:
    RoundelStrategy.register_strategies(StrategyRegistry)
