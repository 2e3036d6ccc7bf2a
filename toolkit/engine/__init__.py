"""Engine backends behind one ABC; the replica process serves one of them to the router."""
