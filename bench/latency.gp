# gnuplot -e "dir='bench/out'" bench/latency.gp: distribution (CDF) of the
# hand-off latency, one curve per wait strategy and number of contenders,
# from bench/handoff.lua's samples (DIR/handoff-<wait>-<n>.txt, ms per line)
set terminal pngcairo size 900,520 font ",10" noenhanced
set output dir.'/handoff.png'
watch = system("ls ".dir."/handoff-watch-*.txt 2>/dev/null | sort -t- -k3,3n")
poll = system("ls ".dir."/handoff-poll-*.txt 2>/dev/null | sort -t- -k3,3n")
set title "Hand-off latency: release -> next waiter's acquire (CDF; solid: watch, dashed: poll)"
set xlabel "latency (ms, log scale)"
set ylabel "fraction of hand-offs"
set logscale x
set grid xtics ytics mxtics
set yrange [0:1]
set key right bottom
label(f) = system("basename ".f." .txt | sed 's/^handoff-//; s/-/, /'")." contenders"
plot for [i=1:words(watch)] word(watch, i) using ($1 > 0 ? $1 : 0.01):(1) smooth cnormal \
       lw 2 lc i dt 1 title label(word(watch, i)), \
     for [i=1:words(poll)] word(poll, i) using ($1 > 0 ? $1 : 0.01):(1) smooth cnormal \
       lw 2 lc i dt 2 title label(word(poll, i))
