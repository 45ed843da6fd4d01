"""NexusKV control plane on etcd: leases, fencing epochs, a watched cluster view, the policy rollout channel."""

from nexuskv_etcd.plane import EtcdControlPlane
from nexuskv_etcd.policy import EtcdPolicyChannel
from nexuskv_etcd.view import ClusterView

__all__ = ["ClusterView", "EtcdControlPlane", "EtcdPolicyChannel"]
