"""rendezvous layer."""
