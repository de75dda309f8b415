"""rounds: the RDP cross-check of the cumulative epsilon, stored when a round publishes

Round.dp_epsilon_total_rdp: Opacus's RDP figure for the privacy history up to and including this round (the
cross-check of dp_epsilon_total, never below it), computed once when the round publishes, as the epsilon is.
GetRound answered it by recomputing it from the whole history. Null = published by an older version (or without
DP): GetRound then computes it from the history as before, so existing rows need nothing.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29 10:00:00.000000

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0007'
down_revision: Union[str, Sequence[str], None] = '0006'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('round', schema=None) as batch_op:
        batch_op.add_column(sa.Column('dp_epsilon_total_rdp', sa.Float(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('round', schema=None) as batch_op:
        batch_op.drop_column('dp_epsilon_total_rdp')
