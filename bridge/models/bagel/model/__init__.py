"""The reference consumer of BAGEL packed batches: a BAGEL-shaped Megatron-Core model, its ``get_batch`` /
``forward_step`` pair (Megatron-Bridge's signatures) and a data-parallel trainer for the main job.

It exists to prove the data contract end to end (tokens land where ``packed_*_indexes`` say, the per-split
attention is what a transformer layer needs, the CE / MSE targets line up, a training run resumes exactly), not
to train a good image model: there is no SigLIP ViT and no VAE (fixed stand-ins, see ``model``). Imports go one
way: this package uses ``bridge.models.bagel.data``; nothing under ``data`` imports it.
"""
