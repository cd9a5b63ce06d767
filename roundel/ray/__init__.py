"""roundel on Ray: the ranks of a job are Ray actors (Horovod's ``horovod.ray``).

``RayExecutor`` runs a fixed number of ranks; ``ElasticRayExecutor`` follows
the cluster's nodes as they come and go. The driver (the process calling
these) runs the job's rendezvous store; each actor's function does
``import roundel.torch as hvd; hvd.init()`` as under ``roundelrun``.
"""

from roundel.ray.elastic import ElasticRayExecutor, RayHostDiscovery
from roundel.ray.runner import RayExecutor
from roundel.ray.settings import RaySettings

__all__ = ["ElasticRayExecutor", "RayExecutor", "RayHostDiscovery", "RaySettings"]
