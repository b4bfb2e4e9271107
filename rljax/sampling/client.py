"""placeholder"""
class RemoteSampler:
    pass
