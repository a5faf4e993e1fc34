"""The KV cache's parts in one place: the driver's paged blocks and prefix cache (`block_manager`,
plain Python), a stage's KV tensors (`tensors`), the disk tier of prefix pages (`disk_tier`) and a
stage's side of moving pages between them (`pages`). Nothing is imported here: the driver must not
load torch by importing the block manager."""
