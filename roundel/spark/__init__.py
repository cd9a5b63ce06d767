"""Run a roundel job inside Spark, as ``horovod.spark`` does: ``roundel.spark.run(fn, num_proc=...)``
and ``roundel.spark.run_elastic(fn, num_proc=..., min_num_proc=...)``.

In ``run`` each rank runs in one task of a Spark barrier stage; the Spark driver runs the
job's rendezvous store. See :mod:`roundel.spark.runner` for the driver and
:mod:`roundel.spark.task` for the tasks; :mod:`roundel.spark.elastic` and
:mod:`roundel.spark.elastic_task` for elastic jobs. Needs ``pyspark`` (and Java).
"""

from roundel.spark.elastic import run_elastic
from roundel.spark.runner import run

__all__ = ["run", "run_elastic"]
