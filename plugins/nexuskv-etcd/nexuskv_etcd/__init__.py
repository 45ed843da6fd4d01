"""NexusKV control plane on etcd: leases, fencing epochs from etcd revisions, a watched cluster view."""

from nexuskv_etcd.plane import EtcdControlPlane
from nexuskv_etcd.view import ClusterView

__all__ = ["ClusterView", "EtcdControlPlane"]
