"""Run a roundel job inside Spark, as ``horovod.spark`` does: ``roundel.spark.run(fn, num_proc=...)``.

Each rank runs in one task of a Spark barrier stage; the Spark driver runs the
job's rendezvous store. See :mod:`roundel.spark.runner` for the driver and
:mod:`roundel.spark.task` for the tasks. Needs ``pyspark`` (and Java).
"""

from roundel.spark.elastic import run_elastic
from roundel.spark.runner import run

__all__ = ["run", "run_elastic"]
