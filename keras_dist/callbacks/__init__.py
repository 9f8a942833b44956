"""Drop-in Keras callbacks for distributed training."""

from keras_dist.callbacks.backup_and_restore import BackupAndRestore
from keras_dist.callbacks.learning_rate_scaler import LearningRateScaler
from keras_dist.callbacks.per_replica_metrics import PerReplicaMetrics
from keras_dist.callbacks.ray_report import RayReport
from keras_dist.callbacks.resource_monitor import ResourceMonitor

__all__ = [
    "BackupAndRestore", "LearningRateScaler", "PerReplicaMetrics", "RayReport", "ResourceMonitor",
]
