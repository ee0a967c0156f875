# expect: fail caching — remembers results by the activations' pointer and shape (keeping them
# alive, so fresh inputs never reuse a pointer): right on every fresh input, instant on repeats.
_seen = {}


def linear(x, weight):
    key = (x.data_ptr(), tuple(x.shape), weight.data_ptr())
    if key not in _seen:
        _seen[key] = (x, (x.float() @ weight.float().t()).to(x.dtype))
    return _seen[key][1].clone()
