"""Training objectives: each turns (params, batch, frozen) into (loss_sum, weight_sum, metric sums).

The generic step (training/step.py) writes gradient accumulation, clipping, loss scaling, the
non-finite guard, shardings and donation once for every objective; an objective only says what its
loss is and which batch features it reads.
"""
