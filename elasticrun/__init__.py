"""elasticrun: elastic distributed PyTorch training launcher with an etcd v3 rendezvous."""

__version__ = "0.2.0"
