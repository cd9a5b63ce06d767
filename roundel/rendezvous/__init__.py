"""The worker's side of joining a job, below ``roundel.common``.

Modules: ``identity`` (a rank's place in the job, from the launcher's
variables), ``store`` (the authenticated key-value store, server and client)
and its ``wire`` format, ``bootstrap`` (finding the store and the identity
under roundelrun, mpirun, srun or torchrun), ``elastic_join`` (joining an
elastic job's next generation), ``network`` (which address to use),
``secret_file`` and ``horovod_gloo`` (Horovod's Gloo launch variables). The
launcher (``roundel.runner``) uses the same store and identity.
"""
