# expect: crash time_limit — spins forever.
def rmsnorm(x, weight, eps):
    while True:
        pass
