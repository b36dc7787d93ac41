p='src/xmig/proxy/oplog.py'
s=open(p).read()
s=s.replace('''    return bool(torch.equal(flat_a, flat_b))''','''    if flat_a.is_cuda:
        import sys, time
        def say(m):
            print(f"DBG {time.monotonic():.3f} {m}", file=sys.stderr, flush=True)
        say(f"numel {flat_a.numel()} stream {torch.cuda.current_stream(flat_a.device).cuda_stream:#x}")
        small = torch.empty(16, dtype=torch.bool, device=flat_a.device)
        say("small alloc ok")
        out = torch.empty(flat_a.shape, dtype=torch.bool, device=flat_a.device)
        say("big alloc ok")
        torch.eq(flat_a, flat_b, out=out)
        say("eq launched")
        ev = torch.cuda.Event(); ev.record()
        t0 = time.monotonic()
        while not ev.query() and time.monotonic() - t0 < 3:
            time.sleep(0.01)
        say(f"eq done={ev.query()}")
    return bool(torch.equal(flat_a, flat_b))''')
open(p,'w').write(s)
