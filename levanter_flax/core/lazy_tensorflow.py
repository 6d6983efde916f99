"""TensorFlow for the input pipeline and gs:// paths, imported on first use and hidden from
every accelerator: the model, partitioning, the step and serving never import it."""
import functools


@functools.cache
def import_tensorflow():
  """Imports TensorFlow, with no GPU or TPU visible to it."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], "GPU")
  tf.config.set_visible_devices([], "TPU")
  return tf
