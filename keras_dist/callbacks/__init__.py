"""Drop-in Keras callbacks for distributed training."""

from keras_dist.callbacks.backup_and_restore import BackupAndRestore

__all__ = ["BackupAndRestore"]
