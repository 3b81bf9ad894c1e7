from flax.training import common_utils

x = common_utils.shard([1, 2])
