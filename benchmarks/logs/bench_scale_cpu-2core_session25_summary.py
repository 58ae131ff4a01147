# Summarises bench_scale JSONs: predicted beside the mean and the median step (older records: the median from their logs .tgz)
import json, sys, statistics as st, glob, os, tarfile, io
for path in sys.argv[1:]:
    d = json.load(open(path))
    print(os.path.basename(path), d['commit'][:7])
    for r in d['runs']:
        if 'error' in r: print('  ', r['case'], 'ERROR', r['error'][:200]); continue
        p = r['planned']
        med = r.get('update_s_median')
        if med is None:  # older script: from the logs in the tgz
            stem = os.path.basename(path)[:-5]
            tf = tarfile.open(f'benchmarks/logs/{stem}.tgz')
            case = r['train_command'].split('train.out_dir=')[1].split()[0].rstrip('/').split('/')[-1]
            ranks = []
            for m in sorted(tf.getnames()):
                if m.endswith(case + '/metrics.jsonl') or (f'/{case}/rank' in m and m.endswith('metrics.jsonl')):
                    ranks.append([json.loads(l) for l in tf.extractfile(m).read().decode().splitlines()])
            med = st.median(max(rk[i]['update_s'] for rk in ranks) for i in range(1, len(ranks[0])))
        print(f"   {r['case'][:38]:38} pred {r['predicted_update_s']*1e3:6.2f} ms | meas mean {r['update_s']*1e3:6.2f} med {med*1e3:6.2f} | p/mean {r['predicted_over_measured']:.2f} p/med {r['predicted_update_s']/med:.2f} | pred io {p['io_s']*1e3:.2f} kern {p['cpu_s']*1e3:.2f} walk {p.get('walk_s',0)*1e3:.2f} norm {p.get('step_s',0)*1e3:.2f} | meas kern {r['cpu_kernel_s']*1e3:.2f} plan_s {r['plan_s']:.1f}")
