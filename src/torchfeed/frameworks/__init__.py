"""Training frameworks that rebuild torch ``DataLoader``\\ s themselves.

Lightning (Trainer and Fabric) and plain torchrun need nothing: :class:`~torchfeed.RemoteDataLoader`
is a ``DataLoader`` subclass that Lightning re-creates with its ``DistributedSampler`` from the
loader's attributes. Accelerate and the HF Trainer build a new *torch* ``DataLoader`` from a
prepared loader's dataset (which would load the remote dataset in the trainer, sample by
sample); their modules here keep the loader remote while every decision stays theirs:

* :mod:`torchfeed.frameworks.accelerate`: ``prepare(accelerator, ...)`` in place of
  ``accelerator.prepare(...)``;
* :mod:`torchfeed.frameworks.transformers`: ``RemoteTrainer``, the HF ``Trainer`` whose
  loaders are remote and whose mid-epoch resume uses the loader's own state.

Each imports its framework only when used.
"""
