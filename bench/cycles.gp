# gnuplot -e "dir='bench/out'" bench/cycles.gp: uncontended cycles/s and
# client CPU per cycle, one bar per implementation (bench/report.lua's data)
set terminal pngcairo size 900,420 font ",10" noenhanced
set output dir.'/cycles.png'
set multiplot layout 1,2 title "Uncontended acquire + release (same stand-in, same run)"
set style data histograms
set style fill solid 0.8 border -1
set boxwidth 0.8
set xtics rotate by -30 scale 0
set grid ytics
unset key
set title "cycles per second (higher is better)"
set yrange [0:*]
plot dir.'/cycles.dat' using 2:xtic(1) lc rgb "#3b6ea8"
set title "client CPU µs per cycle (lower is better)"
plot dir.'/cycles.dat' using 3:xtic(1) lc rgb "#c8553d"
unset multiplot
