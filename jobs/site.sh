# axonmpi site setup: the ONE place to edit for your cluster. Every job template in this folder
# sources it (from the folder you submit in: `sbatch jobs/...`; or set AXONMPI_SITE=/path/to/site.sh).

# EDIT: your site's modules. mpi4py must be built against this MPI (docs/cluster.md).
# module load python openmpi

# EDIT: the virtual environment axonmpi is installed in.
# source ~/venvs/axonmpi/bin/activate

# EDIT: a scratch file system for checkpoints (not $HOME). Defaults to $SCRATCH, else the submit folder.
export AXONMPI_SCRATCH="${AXONMPI_SCRATCH:-${SCRATCH:-$PWD}}"

export PYTHONUNBUFFERED=1   # log lines appear as they are written
