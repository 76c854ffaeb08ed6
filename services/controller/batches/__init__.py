"""From scored trajectories to trained steps. Finished groups wait in the
trajectory pool (`pool`); the processor (`processor`) checks each against
the staleness bound (`staleness`: the gate that admits rollouts, the batch
each is planned into), runs the algorithm on it (`algorithms`: GRPO, DAPO)
and fills train batches (`batching`: trajectories to the trainer's tensors);
the train worker drives TrainStep (`train_worker`); `sample_age` reports
the age of what was trained by completion length."""
