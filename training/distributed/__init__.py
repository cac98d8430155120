"""Several learner processes sharing each step's gradient over ``torch.distributed``.

:mod:`learners` is rank 0's side (:class:`~toolgym.training.distributed.learners.LearnerGroup`, what the
trainer holds), :mod:`step` what every rank runs in a step and the checks between ranks, :mod:`worker`
the loop of ranks 1..N-1, :mod:`ray_actors` those ranks as Ray actors (and :mod:`ray_cluster` the one
Ray connection a run shares), :mod:`fsdp` the sharded form (FSDP2), and :mod:`rendezvous` how the ranks
meet and prove they belong to the run (the threat model).
"""
